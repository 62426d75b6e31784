"""Tools around the runtime, never imported by it: start and stop real SGLang servers
(`server_process`) with their common arguments (`server_args`), stream requests to them
(`streaming`), a real Mooncake store (`mooncake_service`) behind an emulated network link
(`shaped_link`), real prompts from the Python standard library (`prompts`), the HF transformers
float32 reference (`hf_eval`), the distilled drafter's training (`distill`), the performance
model (`perfmodel`) and the generated options page (`gen_options`). The demo, the tests and the
benchmarks share them; a server runs none of them."""
