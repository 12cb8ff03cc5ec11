"""eagle3-assets: train an EAGLE-3 draft model for a target LLM as a Dagster asset graph."""
