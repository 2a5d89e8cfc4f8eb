"""CogVLM / CogAgent out of SAT and back: the Hugging Face layout (:mod:`.hf`), PEFT adapters (:mod:`.peft`),
import from a Hugging Face folder (:mod:`.importer`); the name table (:mod:`.names`)."""
# SAT first: importing it applies the patches, which import the library modules these modules import (a first
# import of SAT from inside one of them would find it half-initialised).
import sat  # noqa: F401,E402
