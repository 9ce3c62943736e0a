"""Names of the engine's choices, importable without torch (the CLI builds its help from them)."""

# The drafter registry's names (``drafting.KINDS``), written out so that the engine's options do
# not import the registry that builds drafters; tests/engine/test_drafters.py fails when they differ.
DRAFTERS = ("auto", "model", "eagle3", "ngram", "suffix", "none")
DRAFT_SERVER_DRAFTERS = ("model", "eagle3")  # what serve-draft can host

DTYPE_NAMES = ("auto", "bfloat16", "float16", "float32")
QUANTIZATIONS = (
    "auto",
    "none",
    "int8",
    "q8_0",
    "q4_0",
    "q4_1",
    "q4_k",
    "q6_k",
)  # auto: as the checkpoint stores it; none: float; q*: GGUF blocks; int8: q8_0
DRAFT_MAX_FRAME_BYTES = 64 * 1024 * 1024  # a draft server's default limit on one step message
