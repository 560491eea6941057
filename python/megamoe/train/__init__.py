"""megamoe.train: a small trainer for transformers MoE causal LMs (FSDP2, expert
parallelism through megamoe, one TOML config). Entry points: `megamoe-train` (trainer.main)
and `megamoe-train-bench` (bench.main); docs/training.md describes both."""
