"""CogVLM / CogAgent out of SAT and back: the Hugging Face layout (:mod:`.hf`), PEFT adapters (:mod:`.peft`),
import from a Hugging Face folder (:mod:`.importer`); the name table (:mod:`.names`)."""
