# Public face of cupy_symbuf.wire.channel_layout (cupy_symbuf/wire/channel_layout.py): keeps ``cupy_symbuf.layout`` importable, every public name and
# attribute access to the rest. The channel layout: how the symmetric buffer is carved by channel, peer and region.
from .wire.channel_layout import *  # noqa: F401,F403
from .wire.channel_layout import __all__  # noqa: F401
from . import wire as _layer

__doc__ = _layer.channel_layout.__doc__  # help() and docs/api.md show the module's own text


def __getattr__(name):
    return getattr(_layer.channel_layout, name)
