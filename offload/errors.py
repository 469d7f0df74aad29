"""Errors of the disk tier."""


class OffloadError(RuntimeError):
    """The disk tier cannot do what was asked (folder not writable, out of space, store damaged).

    A RuntimeError rather than an OSError: it describes the engine's situation (which folder, how
    many bytes needed vs free, what to do), and the OSError that caused it is chained as __cause__.
    """


class StoreCorruptError(OffloadError):
    """Bytes read from a committed store do not match the manifest's checksum (a torn or damaged
    file): the store must not be used; rebuild it from its source."""
