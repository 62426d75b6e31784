"""VeriCache for SGLang: lossless serving on lossy KV caches.

Kept import-light: the CPU finder's `.pth` imports this package in every Python process.
"""

__version__ = "0.1.0"
