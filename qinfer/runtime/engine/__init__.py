"""Generation: slots stepped together, sampling, the tokenizer, streamed text and perplexity."""
