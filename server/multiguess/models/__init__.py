"""Model loading: local folders or hub ids, the embedded default pair."""
