"""CGX-style training: 4-bit max-min bucket quantization of gradients (bucket 512).

  python examples/cgx_quantized_training.py --bits 4 --bucket 512 --data-dir ~/cifar
  python examples/cgx_quantized_training.py --smoke
"""

from _common import base_parser, run


def main(argv=None):
  p = base_parser(__doc__.splitlines()[0])
  p.add_argument("--bits", type=int, default=4)
  p.add_argument("--bucket", type=int, default=512)
  p.add_argument("--nodes", type=int, default=4)
  a = p.parse_args(argv)
  return run(a, model="resnet18", nodes=a.nodes, compress=f"cgx:bits={a.bits},bucket={a.bucket}",
             epochs=30, batch_size=128, lr=0.05, width=32)


if __name__ == "__main__":
  main()
