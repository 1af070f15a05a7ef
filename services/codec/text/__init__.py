"""Text: the tokenizer, chat templates, prompts to token IDs, incremental detokenization, stop strings.
Imports no transport and no web framework.
"""
