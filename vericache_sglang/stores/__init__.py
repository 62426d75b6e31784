"""Remote KV stores SGLang's HiCache can use as its L3 tier, started on 127.0.0.1."""
