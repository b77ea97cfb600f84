# A stand-in for NeMo-RL's image after its venv prefetch step, which cannot be pulled here: the
# checkout at /opt/nemo-rl (the stand-in tests/fixtures/nemo_rl_src at its newest shape), the driver venv
# /opt/nemo_rl_venv and one venv per kind of worker under /opt/ray_venvs, each made by uv and
# holding the checkout as an editable install (the editable wheel `uv sync` installs), vLLM's
# real wheel in the vLLM worker's venv; the driver venv first on PATH, as in NeMo-RL's image.
# uv is the host's binary (.venv's, from make install); SSL_CERT_FILE lets it use the system's CA
# bundle (this machine's HTTPS goes through a proxy with its own CA), as pip does.
FROM localhost/fp32patch-test/debian-python
ENV SSL_CERT_FILE=/etc/ssl/certs/ca-certificates.crt NEMO_RL_VENV_DIR=/opt/ray_venvs
COPY uv /usr/local/bin/uv
COPY nemo-rl /opt/nemo-rl
COPY vllm-*.whl /tmp/stock/
RUN for venv in /opt/nemo_rl_venv $(for w in @WORKER_VENVS@; do echo /opt/ray_venvs/$w; done); do \
      uv venv -q "$venv" && uv pip install -q --python "$venv/bin/python" --no-deps -e /opt/nemo-rl || exit 1; \
    done \
 && uv pip install -q --python /opt/ray_venvs/@VLLM_VENV@/bin/python --no-deps /tmp/stock/vllm-*.whl \
 && rm -rf /tmp/stock
ENV PATH=/opt/nemo_rl_venv/bin:$PATH
