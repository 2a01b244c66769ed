"""Video library code: QuickCodec (`read_video`, `video.quickcodec`), the packet scan and decode
tasks its processes run (`video.codec`), the records a decoder returns (`video.frames`: FrameGroup,
VideoInfo), the H.264 / HEVC writer (`video.encode`) and the synthetic benchmark video (`video.bench`).
Nothing here is a stage; `stages.decode` wraps it for graphs, and `stages.types` re-exports the
records as port types.

    from video import read_video
"""

__all__ = ["read_video", "VideoError"]


def __getattr__(name: str):
    # Lazy: decoder processes import video.codec, and importing this package must not pull torch
    # into them (each would pay about a second for it).
    if name == "read_video":
        from video.quickcodec import read_video
        return read_video
    if name == "VideoError":
        from video.codec import VideoError
        return VideoError
    raise AttributeError(f"module 'video' has no attribute {name!r}")
