"""Training data: corpora and preparing token files (`corpora`), reading them — one
validating reader per format: hpcpipe's HDF5, llm.c's and nanoGPT's `.bin` (`tokens`) —,
tokenizers (bytes, GPT-2's BPE through tiktoken: `tokenizer`), and a run's token file
opened and checked against its config (`checks`).

May import: `parallel` (nothing today), `optim`, `model`, `device`, `util`. Never `config`:
it owns its section ([data]: `section`) and is handed that, never the whole Config.
"""
