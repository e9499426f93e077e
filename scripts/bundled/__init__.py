"""Pieces of the bundled-model build: fact tables, corpus, tokenizer, training, evaluation split."""
