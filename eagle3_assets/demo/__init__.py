"""The embedded demo: a small target LLM and prompt set the project builds itself, offline.

- `world`: the synthetic entities, facts and template tasks (deterministic from a seed).
- `tokenizer`: the byte-level BPE trained on that world, with the reasoning chat template.
- `target`: `build_demo_target(out_dir, demo)` trains and writes the Llama target.
- `prompts`: `demo_prompt_sets(demo)` (pipeline / held-out eval prompts) and their references.
"""
