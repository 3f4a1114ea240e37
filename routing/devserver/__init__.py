"""The development inference server: vLLM's and SGLang's HTTP APIs on machines without a GPU.

It serves a local Hugging Face model on the CPU, or scripted completions scored by one, with
the routes, fields, stopping rules, logprobs, errors and metrics that rollserve relies on of
vLLM's OpenAI-compatible server (`/v1/completions`, `/tokenize`, ...), vLLM's
tokens-in/tokens-out `/inference/v1/generate`, and SGLang's native `/generate` and
`/abort_request`. It is a stand-in that speaks the real APIs, not either server. Entry
points: `cli.main` (`rollserve dev-backend`), `app.create_app`, `tiny.make_tiny_model`.
Importing this package loads neither torch nor transformers.
"""
