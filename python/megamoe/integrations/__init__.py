"""megamoe inside other frameworks' models.

`megamoe.integrations.transformers` serves Hugging Face transformers' MoE experts modules
(import it explicitly; importing `megamoe` or this package does not import transformers,
which is an optional dependency: `pip install "megamoe[hf]"`).
"""
