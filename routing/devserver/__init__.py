"""The development inference server: vLLM's HTTP API on machines without a GPU.

It serves a local Hugging Face model on the CPU, or scripted completions scored by one, with
the routes, fields, stopping rules, logprobs, errors and metrics of vLLM's OpenAI-compatible
server that rollserve relies on. Entry points: `cli.main` (`rollserve dev-backend`),
`app.create_app`, `tiny.make_tiny_model`. Importing this package loads neither torch nor
transformers.
"""
