"""`nonstop bench trl-parity`: nonstop's and TRL's GRPO runs side by side on the same model, data and settings."""
