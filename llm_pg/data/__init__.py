"""Prompts and tasks: the tasks (`tasks`: prompts, eval sets, rewards, answer checking), the LightningDataModule that
yields prompt groups (`datamodule`) and loading a user's own Python (`user_code`). Imports `llm_pg.core` only."""
