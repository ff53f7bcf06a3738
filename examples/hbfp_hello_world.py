"""HBFPEmulator's "hello world": ResNet-18 with HBFP8 (mantissa 8, tile 24) dot products and
16-bit-mantissa wide weight storage.

  python examples/hbfp_hello_world.py --data-dir ~/cifar
  python examples/hbfp_hello_world.py --smoke
"""

from _common import base_parser, run


def main(argv=None):
  p = base_parser(__doc__.splitlines()[0])
  p.add_argument("--mant_bits", type=int, default=8)
  p.add_argument("--bfp_tile_size", type=int, default=24)
  p.add_argument("--weight_mant_bits", type=int, default=16)
  a = p.parse_args(argv)
  return run(a, model="resnet18", nodes=1, hbfp=a.mant_bits, tile=a.bfp_tile_size,
             weight_man=a.weight_mant_bits, epochs=160,
             batch_size=128, lr=0.1, weight_decay=5e-4, width=64)


if __name__ == "__main__":
  main()
