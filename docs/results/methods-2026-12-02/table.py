import json, sys
rows = [json.loads(l) for l in open(sys.argv[1])][1:]
tasks = list(dict.fromkeys(r['task'] for r in rows))
done = [t for t in tasks if sum(r['task'] == t for r in rows) == 31]
budgets = [0.01, 0.02, 0.05, 0.1, 512]
methods = list(dict.fromkeys(r['method'] for r in rows))
def mean(m, b, ts):
    got = [r for r in rows if r['method'] == m and r['budget'] == b and r['task'] in ts]
    return sum(r['score'] for r in got) / len(ts), sum(r['fetched_fraction'] for r in got) / len(ts)
print("tasks:", ", ".join(done))
print("| method | 1% | 2% | 5% | 10% | 512 tokens |\n|---|---|---|---|---|---|")
print(f"| full | {mean('full', None, done)[0]:.3f} | | | | |")
for m in methods:
    if m == 'full': continue
    cells = [mean(m, b, done) for b in budgets]
    print(f"| {m} | " + " | ".join(f"{s:.3f} ({f:.3f})" for s, f in cells) + " |")
print()
short = {'niah_single_1':'s1','niah_single_2':'s2','niah_single_3':'s3','niah_multikey_1':'mk1','niah_multikey_2':'mk2','niah_multikey_3':'mk3','niah_multivalue':'mv','niah_multiquery':'mq','ruler_vt':'vt','ruler_cwe':'cwe','ruler_fwe':'fwe'}
print("| method, budget | " + " | ".join(short[t] for t in done) + " |\n|---|" + "---|" * len(done))
for m in methods:
    for b in ([None] if m == 'full' else budgets):
        sc = []
        for t in done:
            r = [x for x in rows if x['method'] == m and x['budget'] == b and x['task'] == t]
            sc.append(f"{r[0]['score']:.2f}")
        print(f"| {m} {'' if b is None else (f'{b:g}' if b < 1 else f'{b} tok')} | " + " | ".join(sc) + " |")
