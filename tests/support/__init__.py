"""Helpers the test folders share: servers and their registry, routers, KV-event streams, GGUF files, the
llama.cpp tokenizer reference, paged-attention references, doctor logs, a real redis-server. Imported as
`support.<module>`."""
