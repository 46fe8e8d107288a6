"""The gateway's serving layer: what the route families share between validating a body and shaping an answer.

A router (``gateway.routers``) parses its family's body, calls into these modules to get prompt ids,
``SamplingParams`` and deltas, and shapes the result in its own JSON; no router imports another. Nothing
here knows a family's wire format, except ``plans`` (the OpenAI completions and chat requests, which the
generation routes run and the render routes show) and ``shapes`` (bodies every family writes alike).

- ``admission``: ``admit``, whether a request may start now, and the refusals it raises.
- ``engine_errors``: engine failures as API errors.
- ``prompts``: prompt checks (length, truncation) and chat prompts rendered with the model's template.
- ``tools``: how a request uses tools, and the parsers of reasoning and tool calls.
- ``sampling``: the engine's ``SamplingParams`` and the gateway's text options of a request.
- ``choices``: a request's choices run on the engines (``ChoiceRun``, ``run_choices``, ``collect``).
- ``plans``: OpenAI completions and chat requests made ready for the engine (``Plan``).
- ``shapes``: JSON bodies through orjson, and the health answer.
"""
