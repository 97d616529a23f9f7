"""The model folder's own processor (AutoProcessor, local files only): images -> pixel values, and how many
placeholder tokens each image takes.

Nothing here knows a family: the processor class the folder names turns one image into its tensors
(`pixel_values`, `image_grid_thw`, ...) and expands the family's image placeholder into the run of
image tokens the model scatters its features over.

transformers builds the processors of video-capable families (Qwen2-VL, Qwen2.5-VL, ...) with their
video processor, which needs torchvision (a CUDA torch brings it; the CPU build here has none). Without
it the processor is built from the folder's image processor and tokenizer with an empty stand-in of
transformers' own video-processor placeholder: mt-ray trains on images only, so it is never called.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from transformers import AutoProcessor, AutoTokenizer, ProcessorMixin

# From its module: without torchvision, `transformers.AutoImageProcessor` is a placeholder that refuses to load.
from transformers.models.auto.image_processing_auto import AutoImageProcessor
from transformers.models.auto.processing_auto import PROCESSOR_MAPPING_NAMES

from mt_ray.errors import ConfigError

IMAGE_PROCESSOR_FILES = ("preprocessor_config.json", "processor_config.json")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt", "spiece.model")
# Files a processor is saved as; the export copies them beside the weights.
PROCESSOR_FILES = ("preprocessor_config.json", "processor_config.json", "video_preprocessor_config.json",
                   "chat_template.json", "chat_template.jinja")


def processor_files(folder: str | Path) -> tuple[Path, ...]:
    """The processor's files in `folder` (what an export copies beside the weights)."""
    return tuple(Path(folder) / f for f in PROCESSOR_FILES if (Path(folder) / f).is_file())


def check_processor_files(folder: str | Path, key: str = "model.path") -> Path:
    """An image-text model's folder must hold its processor: name the files that are missing."""
    folder = Path(folder)
    missing = []
    if not any((folder / f).is_file() for f in IMAGE_PROCESSOR_FILES):
        missing.append(f"the image processor ({' or '.join(IMAGE_PROCESSOR_FILES)})")
    if not any((folder / f).is_file() for f in TOKENIZER_FILES):
        missing.append(f"the tokenizer (one of {', '.join(TOKENIZER_FILES)}, with tokenizer_config.json)")
    if missing:
        raise ConfigError(f"{key}: {folder} is an image-text model but lacks {' and '.join(missing)}; copy the "
                          "processor files from the base model (what AutoProcessor.save_pretrained writes)")
    return folder


def load_processor(folder: str | Path) -> ProcessorMixin:
    """The folder's processor, from local files only."""
    folder = check_processor_files(folder)
    try:
        return AutoProcessor.from_pretrained(folder, local_files_only=True)
    except ImportError as e:
        if "orchvision" not in str(e):
            raise
    return _without_video(folder)


def _without_video(folder: Path) -> ProcessorMixin:
    """The folder's processor class around its image processor and tokenizer, a bare video processor standing in."""
    import transformers

    cls = _processor_class(folder)
    image_processor = AutoImageProcessor.from_pretrained(folder, local_files_only=True)
    tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    parts: dict[str, Any] = {"image_processor": image_processor, "tokenizer": tokenizer}
    if "video_processor" in cls.get_attributes():
        # The processor checks the type against transformers.BaseVideoProcessor, a placeholder without
        # torchvision; an instance made without its constructor passes and is never used.
        parts["video_processor"] = object.__new__(transformers.BaseVideoProcessor)
    return cls(**parts, chat_template=tokenizer.chat_template)


def _processor_class(folder: Path) -> type[ProcessorMixin]:
    import transformers

    name = None
    for file in ("processor_config.json", "preprocessor_config.json", "config.json"):
        path = folder / file
        if path.is_file():
            data = json.loads(path.read_text())
            name = data.get("processor_class") or PROCESSOR_MAPPING_NAMES.get(data.get("model_type", ""))
            if name:
                break
    if name is None or not hasattr(transformers, name):
        raise ConfigError(f"model.path: {folder} names no processor class transformers knows ({name}); copy the "
                          "processor files from the base model")
    return getattr(transformers, name)


class ImageEncoder:
    """One image at a time through the model's processor: its tensors, and the token ids that stand for it.

    `image_text` is what the family's chat template writes for one image (Qwen: the image token between
    vision start and end; LLaVA: `<image>`); the processor turns it into the run of image tokens the
    model scatters that image's features over (`encode`).
    """

    def __init__(self, processor: ProcessorMixin, max_pixels: int | None = None, min_pixels: int | None = None):
        self.processor = processor
        self.max_pixels, self.min_pixels = max_pixels, min_pixels
        tokenizer = processor.tokenizer
        self.image_token_id = getattr(processor, "image_token_id", None)
        if self.image_token_id is None:
            self.image_token_id = tokenizer.convert_tokens_to_ids(processor.image_token)
        self.image_text = _image_text(processor)
        self.text_ids = tokenizer.encode(self.image_text, add_special_tokens=False)

    def encode(self, path: Path) -> tuple[list[int], dict[str, Any]]:
        """The expanded token ids of one image and its tensors (`pixel_values`, `image_grid_thw`, ...)."""
        from PIL import Image

        with Image.open(path) as image:
            rgb = self._resized(image.convert("RGB"))  # decodes the pixels: this runs in the loader's worker
        out = self.processor(text=[self.image_text], images=[rgb], return_tensors="pt")
        tensors = {k: v for k, v in out.items() if k not in _TEXT_KEYS}
        return out["input_ids"][0].tolist(), tensors


    def _resized(self, image):
        """Scaled into [min_pixels, max_pixels] keeping its aspect, as LLaMA-Factory's `_preprocess_image` does."""
        for bound, too_far in ((self.max_pixels, lambda n, b: n > b), (self.min_pixels, lambda n, b: n < b)):
            if bound is not None and too_far(image.width * image.height, bound):
                factor = math.sqrt(bound / (image.width * image.height))
                image = image.resize((int(image.width * factor), int(image.height * factor)))
        return image


# What a processor returns for the text rather than the image (PaliGemma's labels its text's suffix).
_TEXT_KEYS = ("input_ids", "attention_mask", "token_type_ids", "mm_token_type_ids", "labels")


def _image_text(processor: ProcessorMixin) -> str:
    """What the processor's chat template renders for one image, else the bare image token."""
    token = processor.image_token
    template = getattr(processor, "chat_template", None) or processor.tokenizer.chat_template
    if not template:
        return token
    text = [{"type": "text", "text": "x"}]

    def render(content: list[dict]) -> str:
        return processor.tokenizer.apply_chat_template([{"role": "user", "content": content}], chat_template=template,
                                                       tokenize=False)

    try:
        with_image, without = render([{"type": "image"}, *text]), render(text)
    except Exception:  # a template that takes string content only fails in its own way; the bare token then
        return token
    start = next((i for i, (a, b) in enumerate(zip(with_image, without, strict=False)) if a != b), len(without))
    inserted = with_image[start:len(with_image) - (len(without) - start)]
    return inserted if token in inserted else token
