"""Min round seconds of pflego's PGFed/APFL on the bench's MLP setting (works at 39804bc and main)."""
import sys, time
import torch
from pflego.config import load_config
from pflego.data import load_dataset
from pflego.sim import Simulation
from pflego.sim.build import Experiment, experiment_on, partition
torch.set_num_threads(1)
algo, model, rounds = sys.argv[1], sys.argv[2], int(sys.argv[3])
settings = dict(dataset="mnist", data_dir="/work/shared/data/mnist", clients=100, participation=0.2,
    classes_per_client=2, batch_size=10, local_epochs=1.0, client_lr=0.01, rounds=rounds + 1, seed=0,
    algorithm=algo, model=model, backend="fused", eval_every=1000)
cfg = load_config(settings)
raw = load_dataset(cfg.dataset, cfg.data_dir, seed=cfg.seed)
base = Experiment(cfg, partition(raw, cfg), None)
sim = Simulation(experiment_on(cfg, base.data), None)
sim.run_round(0)
ts = []
for t in range(1, rounds + 1):
    s = time.perf_counter(); sim.run_round(t); ts.append(time.perf_counter() - s)
print(f"{algo} {model} min {min(ts):.3f} median {sorted(ts)[len(ts)//2]:.3f}")
