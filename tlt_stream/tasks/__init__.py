"""The tiny default world: a long-tailed reasoning task, its tokenizer, and the bootstrap."""
