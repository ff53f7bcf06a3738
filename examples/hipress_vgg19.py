"""HiPress-style VGG-19 training with a gradient compressor, and its SeCoPa plan.

  python examples/hipress_vgg19.py --compress tbq:threshold=0.01 --data-dir ~/cifar
  python examples/hipress_vgg19.py --all --smoke     # every compressor, built-in data
"""

from _common import base_parser, run

COMPRESSORS = ["cgx:bits=4", "onebit", "tbq:threshold=0.01", "terngrad", "dgc:ratio=0.01",
               "graddrop:drop_ratio=0.9", "topk:ratio=0.01", "randomk:ratio=0.01",
               "powersgd:rank=2", "cast:fmt=BF16"]


def main(argv=None):
  p = base_parser(__doc__.splitlines()[0])
  p.add_argument("--compress", default="tbq:threshold=0.01")
  p.add_argument("--all", action="store_true", help="run every compressor in turn")
  p.add_argument("--nodes", type=int, default=4)
  a = p.parse_args(argv)
  from jaxlp.cli import main as cli

  cli(["plan", "--model", "vgg19", "--nodes", str(a.nodes), "--width", "4" if a.smoke else "64"])
  specs = COMPRESSORS if a.all else [a.compress]
  out = []
  for spec in specs:
    print(f"-- {spec}")
    # DGC's momentum correction replaces SGD's momentum (jaxlp train refuses both)
    momentum = 0.0 if spec.startswith("dgc") else 0.9
    out.append(run(a, model="vgg19", nodes=a.nodes, compress=spec, epochs=30, batch_size=128,
                   lr=0.05, width=64, momentum=momentum))
  return out


if __name__ == "__main__":
  main()
