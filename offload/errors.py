"""Errors of the disk tier."""


class OffloadError(RuntimeError):
    """The disk tier cannot do what was asked (folder not writable, out of space, store damaged).

    A RuntimeError rather than an OSError: it describes the engine's situation (which folder, how
    many bytes needed vs free, what to do), and the OSError that caused it is chained as __cause__.
    """


class StoreCorruptError(OffloadError):
    """Bytes read from a committed store do not match the manifest's checksum (a torn or damaged
    file): the store must not be used; rebuild it from its source."""


class UnquantizableWeight(OffloadError):
    """A weight the plan compresses has a group whose minimum or step is not a finite fp16 (a NaN
    or inf among its values, or a magnitude beyond fp16's): found by quantize's own check of the
    scales as the weight is placed, the only look at its values when the source leaves it unchecked."""

    def __init__(self, layer: int, name: str, why: str):
        super().__init__(f"weight {name} of layer {layer} cannot be quantized: {why}")
        self.layer, self.name = layer, name
