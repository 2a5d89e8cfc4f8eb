"""LoRA: the layer (by reference, model-parallel aware, merged in place) and QLoRA's NF4 bases."""
# SAT first: importing it applies the patches, and the LoRA patches import this package's modules (a first
# import of SAT from inside one of them would find it half-initialised).
import sat  # noqa: F401,E402
