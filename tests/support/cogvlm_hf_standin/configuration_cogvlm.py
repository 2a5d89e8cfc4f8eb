"""Stand-in for cogvlm-chat-hf's ``configuration_cogvlm.py`` (written for sat_patches' tests, not upstream's):
the fields the stand-in model reads, under the names of the released ``config.json``."""
from transformers import PretrainedConfig


class CogVLMConfig(PretrainedConfig):
    def __init__(self, vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_attention_heads=32,
                 num_hidden_layers=32, hidden_act="silu", rms_norm_eps=1e-6, vision_config=None, **kwargs):
        self.vocab_size, self.hidden_size, self.intermediate_size = vocab_size, hidden_size, intermediate_size
        self.num_attention_heads, self.num_hidden_layers = num_attention_heads, num_hidden_layers
        self.hidden_act, self.rms_norm_eps, self.vision_config = hidden_act, rms_norm_eps, vision_config or {}
        super().__init__(**kwargs)
