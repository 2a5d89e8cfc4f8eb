"""LoRA: the layer (by reference, model-parallel aware, merged in place) and QLoRA's NF4 bases."""
