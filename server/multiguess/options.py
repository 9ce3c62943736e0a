"""Names of the engine's choices, importable without torch (the CLI builds its help from them)."""

DTYPE_NAMES = ("auto", "bfloat16", "float16", "float32")
QUANTIZATIONS = ("none", "int8")
DRAFTERS = ("model", "eagle3", "ngram", "none")
