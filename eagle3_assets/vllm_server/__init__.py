"""The vLLM server behind the `vllm` backends, split by concern.

client.py      HTTP: JSON requests and their errors, health, the served model, free ports
protocol.py    the hidden-states file protocol shared by the connector and the extractor
connector.py   the KV connector that runs inside vLLM and writes the files (imports vLLM)
command.py     the `vllm serve` command line of a role, and the server plan
cores.py       the CPU cores each engine we start binds to: its own, claimed in a host-wide registry
server.py      VllmServer: start (under the supervisor), attach, stop
supervisor.py  stops a server whose starter died
__main__.py    `python -m eagle3_assets.vllm_server --serve` (and `--supervise`)

Nothing is imported here, so the supervisor process stays small.
"""
