#!/usr/bin/env python3
"""Checks a rendered kvtier overlay (`kubectl kustomize deploy/k8s/overlays/X`)
for agreement across its objects: selectors, labels, ports, probes, service
names, the addresses and flags in the containers' arguments.

    kubectl kustomize deploy/k8s/overlays/cluster | deploy/k8s/check.py --help_dir=HELP

--help_dir holds BINARY.help files (each binary's --help output); every
--flag a container passes must be listed there. Prints each problem and exits
1 when there is one."""

import argparse
import re
import sys

import yaml

WORKLOADS = ("Deployment", "StatefulSet")


def matches(selector, labels):
    return bool(selector) and all(labels.get(k) == v for k, v in selector.items())


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--help_dir", required=True)
    ap.add_argument("--name", default="overlay")
    a = ap.parse_args()
    docs = [d for d in yaml.safe_load_all(sys.stdin) if d]
    problems = []

    def bad(obj, msg):
        problems.append(f"{a.name}: {obj['kind']}/{obj['metadata']['name']}: {msg}")

    by_kind = {}
    for d in docs:
        by_kind.setdefault(d["kind"], []).append(d)
        if d["metadata"].get("labels", {}).get("app.kubernetes.io/part-of") != "kvtier":
            bad(d, "lacks the label app.kubernetes.io/part-of=kvtier")
    workloads = [d for d in docs if d["kind"] in WORKLOADS]
    services = {d["metadata"]["name"]: d for d in by_kind.get("Service", [])}

    def pods(selector):
        return [w for w in workloads
                if matches(selector, w["spec"]["template"]["metadata"].get("labels", {}))]

    helps = {}

    def help_of(binary):
        if binary not in helps:
            try:
                with open(f"{a.help_dir}/{binary.rsplit('/', 1)[-1]}.help") as f:
                    helps[binary] = f.read()
            except OSError:
                helps[binary] = None
        return helps[binary]

    for w in workloads:
        spec = w["spec"]
        tlabels = spec["template"]["metadata"].get("labels", {})
        if not matches(spec["selector"]["matchLabels"], tlabels):
            bad(w, "selector does not match its own pod template's labels")
        if w["kind"] == "StatefulSet":
            svc = services.get(spec.get("serviceName"))
            if svc is None:
                bad(w, f"serviceName {spec.get('serviceName')} is not a Service here")
            elif svc["spec"].get("clusterIP") != "None":
                bad(w, f"serviceName {svc['metadata']['name']} is not headless")
        for c in spec["template"]["spec"]["containers"]:
            ports = {p["name"]: p["containerPort"] for p in c.get("ports", [])}
            for probe in ("readinessProbe", "livenessProbe"):
                p = c.get(probe)
                if p is None:
                    if probe == "readinessProbe":
                        bad(w, f"container {c['name']} has no readinessProbe")
                    continue
                port = (p.get("httpGet") or p.get("tcpSocket") or {}).get("port")
                if isinstance(port, str) and port not in ports:
                    bad(w, f"{probe} port {port} is not a port of container {c['name']}")
            if not c.get("resources", {}).get("requests"):
                bad(w, f"container {c['name']} requests no resources")
            # Flags: each --flag is one the binary knows.
            binary = (c.get("command") or [""])[0]
            text = help_of(binary)
            if text is None:
                bad(w, f"no --help text for {binary}")
                continue
            env = {e["name"] for e in c.get("env", [])}
            for arg in c.get("args", []):
                m = re.match(r"--([a-z][a-z0-9_-]*)(=|$)", arg)
                if not m:
                    bad(w, f"argument {arg!r} is not --flag=value")
                    continue
                if not re.search(rf"(^|\s)--{re.escape(m.group(1))}[\s=(]", text):
                    bad(w, f"{binary} has no flag --{m.group(1)}")
                for var in re.findall(r"\$\(([A-Z_]+)\)", arg):
                    if var not in env:
                        bad(w, f"argument {arg!r} uses $({var}), which the container does not set")
                # Addresses of other kvtier objects: NAME[-N.SVC]:PORT or http://NAME:PORT.
                for host, port in re.findall(r"(?:=|//)([a-z][a-z0-9-]*(?:\.[a-z][a-z0-9-]*)?):(\d+)", arg):
                    svc_name = host.split(".")[-1]
                    svc = services.get(svc_name)
                    if svc is None:
                        bad(w, f"argument {arg!r} names {svc_name}, which is not a Service here")
                    elif int(port) not in [p["port"] for p in svc["spec"]["ports"]]:
                        bad(w, f"argument {arg!r}: Service {svc_name} has no port {port}")
    for name, s in services.items():
        sel = s["spec"].get("selector", {})
        targets = pods(sel)
        if not targets:
            bad(s, f"selector {sel} matches no pod template")
        for p in s["spec"]["ports"]:
            tp = p.get("targetPort", p["port"])
            for w in targets:
                cports = [cp for c in w["spec"]["template"]["spec"]["containers"]
                          for cp in c.get("ports", [])]
                if isinstance(tp, str):
                    ok = any(cp["name"] == tp for cp in cports)
                else:
                    ok = any(cp["containerPort"] == tp for cp in cports)
                if not ok:
                    bad(s, f"targetPort {tp} is not a port of {w['kind']}/{w['metadata']['name']}")
    for pdb in by_kind.get("PodDisruptionBudget", []):
        if not pods(pdb["spec"]["selector"]["matchLabels"]):
            bad(pdb, "selector matches no pod template")
    for sm in by_kind.get("ServiceMonitor", []):
        sel = sm["spec"]["selector"]["matchLabels"]
        matched = [s for s in services.values() if matches(sel, s["metadata"].get("labels", {}))]
        if not matched:
            bad(sm, "selector matches no Service")
        for ep in sm["spec"]["endpoints"]:
            for s in matched:
                if ep["port"] not in [p.get("name") for p in s["spec"]["ports"]]:
                    bad(sm, f"Service {s['metadata']['name']} has no port named {ep['port']}")
    for dr in by_kind.get("DestinationRule", []):
        if dr["spec"]["host"] not in services:
            bad(dr, f"host {dr['spec']['host']} is not a Service here")
    for vs in by_kind.get("VirtualService", []):
        for route in vs["spec"].get("http", []):
            for r in route.get("route", []):
                d = r["destination"]
                svc = services.get(d["host"])
                if svc is None:
                    bad(vs, f"destination {d['host']} is not a Service here")
                elif "port" in d and d["port"]["number"] not in [p["port"] for p in svc["spec"]["ports"]]:
                    bad(vs, f"destination {d['host']} has no port {d['port']['number']}")
    for p in problems:
        print(p)
    kinds = sorted(f"{k} x{len(v)}" for k, v in by_kind.items())
    print(f"{a.name}: {len(docs)} objects ({', '.join(kinds)}), "
          f"{'OK' if not problems else f'{len(problems)} problems'}")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
