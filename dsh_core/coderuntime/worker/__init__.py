"""Code that runs inside the worker process: standard library only.

Nothing here may import ``dsh_core`` or any third-party package: the zygote
loads these files by path in a bare ``-I -S`` interpreter. The host imports
:mod:`.wire` and :mod:`.program` as ordinary modules.
"""
