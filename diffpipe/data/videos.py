"""Video files in data folders: mp4, webm, mkv, mov and avi, read with PyAV (FFmpeg's Python binding), captioned
like images (a same-named .txt, or metadata.jsonl).

A video trains as one clip: its first F frames, F the longest of `data.frame_buckets` it fills (frames at the
file's own rate). Files that cannot be used (not a video, no video stream, truncated, shorter than every frame
bucket) are skipped and counted with the images, never a crash mid-run. The rotation tag of phone videos is not
applied.
"""
from __future__ import annotations

from pathlib import Path

from PIL import Image

from ..errors import BadImage

__all__ = ["VIDEO_SUFFIXES", "probe_video", "read_clip", "clip_frames"]

VIDEO_SUFFIXES = (".mp4", ".webm", ".mkv", ".mov", ".avi")


def _pyav():
    """PyAV, imported where a video is read: a run on images never loads FFmpeg's libraries (nor needs them)."""
    import av

    return av


def _decode_errors() -> tuple[type[BaseException], ...]:
    return (_pyav().FFmpegError, OSError, ValueError, IndexError, EOFError)


def probe_video(path: Path) -> tuple[int, int, int, float]:
    """(width, height, frames, frames a second) of the first video stream, from the container without decoding
    pictures; counts the stream's packets where the container does not say (webm)."""
    try:
        with _pyav().open(str(path)) as container:
            if not container.streams.video:
                raise BadImage("no video stream")
            stream = container.streams.video[0]
            rate = float(stream.average_rate or stream.guessed_rate or 0.0)
            frames = stream.frames or sum(1 for packet in container.demux(stream) if packet.size)
            return stream.codec_context.width, stream.codec_context.height, frames, rate
    except _decode_errors() as exc:
        raise BadImage(f"not a readable video ({type(exc).__name__})") from None


def read_clip(path: Path, count: int) -> list[Image.Image]:
    """The first `count` frames as 8-bit RGB images; `BadImage` when fewer can be decoded."""
    frames: list[Image.Image] = []
    try:
        with _pyav().open(str(path)) as container:
            for frame in container.decode(video=0):
                frames.append(frame.to_image())
                if len(frames) == count:
                    break
    except _decode_errors() as exc:
        raise BadImage(f"cannot be decoded after {len(frames)} frames ({type(exc).__name__})") from None
    if len(frames) < count:
        raise BadImage(f"only {len(frames)} of the {count} frames its clip needs could be decoded (truncated?)")
    return frames


def clip_frames(frames: int, buckets: list[int]) -> int | None:
    """The clip length a file of `frames` frames trains at (a still image: frames 0): the longest frame bucket it
    fills, a video taking 1 only when no bucket is longer; None when it fits none."""
    if frames == 0:
        return 1 if 1 in buckets else None
    longer = [b for b in buckets if 1 < b <= frames] or ([1] if buckets == [1] else [])
    return max(longer) if longer else None
