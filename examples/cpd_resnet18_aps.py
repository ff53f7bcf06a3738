"""CPD's ResNet-18 / CIFAR-10 experiment: low-precision gradient all-reduce with/without APS.

Same knobs as CPD's ``example/ResNet18/tools/mix.py``: ``--grad_exp``, ``--grad_man``,
``--use_APS``, ``--use_kahan``, ``--use_lars``, ``--emulate_node`` (workers = 8 x emulate).

  python examples/cpd_resnet18_aps.py --grad_exp 4 --grad_man 3 --use_APS --data-dir ~/cifar
  python examples/cpd_resnet18_aps.py --grad_exp 3 --grad_man 0 --use_APS --smoke
"""

from _common import base_parser, run


def main(argv=None):
  p = base_parser(__doc__.splitlines()[0])
  p.add_argument("--grad_exp", "--grad-exp", type=int, default=5)
  p.add_argument("--grad_man", "--grad-man", type=int, default=2)
  p.add_argument("--use_APS", "--use-APS", action="store_true")
  p.add_argument("--use_kahan", "--use-kahan", action="store_true")
  p.add_argument("--use_lars", "--use-lars", action="store_true")
  p.add_argument("--emulate_node", "--emulate-node", type=int, default=1)
  p.add_argument("--nodes", type=int, default=8, help="real workers before emulation (8 GPUs)")
  a = p.parse_args(argv)
  return run(a, model="resnet18", nodes=a.nodes * a.emulate_node, grad_exp=a.grad_exp,
             grad_man=a.grad_man, aps=a.use_APS, kahan=a.use_kahan, lars=a.use_lars,
             order="chain", epochs=100, batch_size=512, lr=0.1, weight_decay=1e-4, width=64)


if __name__ == "__main__":
  main()
