"""`llm`: one colocated vLLM engine that takes raw encoded images and videos, or audio (the baseline).

Thin by design: requests are parsed by python_backends.request.generate, served by
python_backends.engines.llm; the request/error/cancel policy is
python_backends.triton_edge.decoupled's.
"""

from pathlib import Path

from python_backends import contract
from python_backends.engines.llm import LlmEngine, load_engine_args
from python_backends.engines.videos import VideoInputLimits, load_videos
from python_backends.request.audios import AudioInput
from python_backends.request.generate import parse_generate_request, request_limits
from python_backends.request.generation_defaults import defaults_for_model
from python_backends.request.image_embeds import EmbedsSpec
from python_backends.request.images import decode_images
from python_backends.triton_edge.decoupled import DecoupledModel


class TritonPythonModel(DecoupledModel):
    INPUTS = contract.LLM.input_names
    CLIENT_ABORT = True  # request_id + abort: stop a request in-band (docs/operations.md)

    def setup(self, args):
        hidden = self.params.integer(contract.IMAGE_EMBEDS_HIDDEN_SIZE)
        # Embeddings by value (the ensemble, or a client that ran encode itself); refused when
        # the repository was generated without the encoder's facts.
        embeds = EmbedsSpec(hidden, self.params.integer(contract.SPATIAL_MERGE_SIZE)) if hidden else None
        self.videos = VideoInputLimits.from_params(self.params)
        max_videos = self.videos.limits.max_videos if self.videos else 0
        self.audio = AudioInput.from_params(self.params)  # an audio checkpoint's llm only
        max_audios = self.audio.max_audios if self.audio else 0
        # The checkpoint's sampling defaults (generation_config parameter, as `vllm serve`), read
        # before the engine starts: a bad setting fails the load at once.
        engine_args = load_engine_args(Path(args["model_repository"]) / args["model_version"] / "engine_args.json")
        defaults = defaults_for_model(self.params, Path(engine_args["model"]))
        self.limits = request_limits(
            self.params, embeds, max_videos=max_videos, max_audios=max_audios, sampling_defaults=defaults
        )
        self.engine = self.start_engine(args, LlmEngine)

    def parse(self, inputs, request):
        parsed = parse_generate_request(inputs, self.limits)
        # Videos are checked from their headers, then read by vLLM's own loader, here; audio is
        # decoded here (FFmpeg): a bad item is refused before the engine sees the request.
        videos = load_videos(parsed.videos, self.videos)
        audios = [(clip, self.audio.sampling_rate) for clip in self.audio.decode(parsed.audios)] if self.audio else []
        return parsed, decode_images(parsed.images, self.limits.images), videos, audios

    def serve(self, parsed, request_id):
        request, images, videos, audios = parsed
        return self.engine.generate(request, images, request_id, videos, audios)
