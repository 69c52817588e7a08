"""Reference models in pure Flax NNX, annotated with logical axes: ``MLP``, ``GPT``, ``Llama``.

All build and run on one device with no mesh; a strategy reads their logical names
(``"embed"``, ``"mlp"``, ``"heads"``, ``"kv"``, ``"vocab"``, ``"layers"``, ...) and shards them.
``ParallelGPT`` is the GPT built from Megatron's explicit layers. The models are networks
of the layers in ``parallax.nn`` (below this package); the layer names this package has
always exported (``MoE``, ``MoEConfig``, ``moe_aux_loss``, ``RopeScaling``) are
re-exported from there. See ``docs/models.md``.
"""

from parallax.models.gpt import GPT as GPT
from parallax.models.gpt_config import GPTConfig as GPTConfig
from parallax.models.gpt import block_forward as block_forward
from parallax.models.gpt_config import flops_per_token as flops_per_token
from parallax.models.losses import next_token_loss as next_token_loss
from parallax.models.gpt_config import param_count as param_count
from parallax.models.gpt_pipeline import next_token_stages as next_token_stages
from parallax.models.llama import Llama as Llama
from parallax.models.llama import llama_stages as llama_stages
from parallax.models.llama_config import LlamaConfig as LlamaConfig
from parallax.models.llama_config import llama_flops_per_token as llama_flops_per_token
from parallax.models.llama_config import llama_param_count as llama_param_count
from parallax.nn.rope import RopeScaling as RopeScaling
from parallax.models.mlp import MLP as MLP
from parallax.models.parallel_gpt import ParallelBlock as ParallelBlock
from parallax.models.parallel_gpt import ParallelGPT as ParallelGPT
from parallax.models.parallel_gpt import parallel_next_token_loss as parallel_next_token_loss
from parallax.nn.moe import MoE as MoE
from parallax.nn.moe import aux_loss as moe_aux_loss
from parallax.nn.moe_config import MoEConfig as MoEConfig
from parallax.models.losses import moe_next_token_loss as moe_next_token_loss
from parallax.models.mlp import mse_loss as mse_loss
from parallax.models.pretrained import from_pretrained as from_pretrained
from parallax.models.pretrained import save_pretrained as save_pretrained
from parallax.models.generation import generate as generate

__all__ = [
    "GPT",
    "GPTConfig",
    "Llama",
    "LlamaConfig",
    "MLP",
    "MoE",
    "MoEConfig",
    "ParallelBlock",
    "ParallelGPT",
    "block_forward",
    "flops_per_token",
    "from_pretrained",
    "generate",
    "llama_flops_per_token",
    "llama_param_count",
    "llama_stages",
    "moe_aux_loss",
    "moe_next_token_loss",
    "mse_loss",
    "next_token_loss",
    "next_token_stages",
    "param_count",
    "parallel_next_token_loss",
    "save_pretrained",
    "RopeScaling",
]
