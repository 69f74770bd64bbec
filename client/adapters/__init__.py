"""Adapters from RL frameworks' inference calls to the router (``docs/integrations.md``).

- ``areal``: AReaL's remote-vLLM backend, labelled, with its pause and weight-update calls
  routed through the router's admin API;
- ``verl``: verl's ``AsyncLLMServerManager.generate`` over HTTP, sticky by ``request_id``;
- ``skyrl``: SkyRL's ``InferenceEngineInterface`` (``RemoteInferenceClient``'s place), each
  trajectory one session, its pause, sleep and weight-sync calls through the admin API;
- ``openai_agent``: a multi-turn agent loop on the official ``openai`` client.
- ``actions``: what a framework's control request becomes on the admin API (shared by
  ``areal`` and ``skyrl``).

None imports its framework: each speaks the framework's request and response shapes (pinned
in ``tests/client`` with the framework commit they were read from).
"""
