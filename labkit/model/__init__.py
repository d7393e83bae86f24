from labkit.model.attention import ATTENTION_BACKENDS, get_attention
from labkit.model.flops import count_params, flops_per_token
from labkit.model.gpt import GPT, GPTShape

__all__ = ["GPT", "GPTShape", "ATTENTION_BACKENDS", "get_attention", "count_params", "flops_per_token"]
