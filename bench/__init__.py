"""MISA-T's benchmarks and measurement harnesses (``misat_bench``), kept apart from the simulator.

The ``misat bench`` suite (``main``: the CLI; ``suite``: workloads and baselines
as data; ``cluster_runs``: the in-process cluster layer; ``http_layer``: the real
``vllm-router`` binary vs this router over HTTP; ``report``: table, JSON and
plot), the trace-replay fidelity harness against real vLLM (``fidelity``,
``real_vllm``, ``tiny_model``), and stand-alone measurements run as
``python -P -m misat_bench.<name>``: ``engine_speed``, ``soak``,
``choose_defaults``, ``policy_microbench``, ``gpu_attention_calibration``.
Everything here builds on ``misat_sim`` and ``misat_router``; neither imports it.
"""
