"""mingpt: a Hydra-configured trainer for character-level GPT models, from one CPU to many GPUs."""
