# A stand-in for vLLM's image (vllm/vllm-openai:vVERSION), which cannot be pulled here: Debian's
# Python with vLLM's own wheel installed --no-deps into a venv that is first on PATH (torch and
# vLLM's other requirements are not needed to patch or verify it). The recipe test builds README's
# Dockerfile FROM this image, under that name.
FROM localhost/fp32patch-test/debian-python
RUN python3 -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH
COPY vllm-*.whl /tmp/stock/
RUN pip install --no-deps --no-compile /tmp/stock/vllm-*.whl && rm -rf /tmp/stock
