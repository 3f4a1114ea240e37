"""Bring your own agent: a per-job endpoint that speaks the OpenAI and Anthropic APIs.

A harness (mini-swe-agent, an OpenAI Agents SDK program, a command-line coding agent) talks
to its own job's endpoint with a key of its own; every request is rendered into ids with the
served model's chat template, the engine gets ids and returns ids, and the job's trajectory
records exactly those ids (`workers.harness.session`). The API shapes (`openai_chat`,
`openai_responses`, `anthropic_messages`) only translate between the wire and `wire`'s
canonical request and result.
"""
