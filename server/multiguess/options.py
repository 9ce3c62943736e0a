"""Names of the engine's choices, importable without torch (the CLI builds its help from them)."""

from multiguess.drafting import DRAFT_SERVER_DRAFTERS as DRAFT_SERVER_DRAFTERS  # the registry's
from multiguess.drafting import DRAFTERS as DRAFTERS

DTYPE_NAMES = ("auto", "bfloat16", "float16", "float32")
QUANTIZATIONS = (
    "none",
    "int8",
    "q8_0",
    "q4_0",
    "q4_1",
    "q4_k",
    "q6_k",
)  # int8: torch dynamic; q*: GGUF blocks
DRAFT_MAX_FRAME_BYTES = 64 * 1024 * 1024  # a draft server's default limit on one step message
