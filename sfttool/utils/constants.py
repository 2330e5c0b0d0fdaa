"""Constants shared by the encoder, collator and model."""

# Label value the loss ignores (torch.nn.CrossEntropyLoss's default ignore_index).
IGNORE_INDEX = -100
# Token id used to pad input_ids when a tokenizer has no pad token.
DEFAULT_PAD_TOKEN_INDEX = 0
