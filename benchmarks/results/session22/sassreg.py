import re, sys, collections
s = open(sys.argv[1]).read()
ins = re.findall(r"/\*([0-9a-f]{4,})\*/\s+((?:@!?U?P\w+\s+)?)([A-Z][A-Z0-9_.]+)([^;]*);", s)
print(len(ins))
marks = [(i, op, args) for i, (a, p, op, args) in enumerate(ins) if "MAXREG" in op or op.startswith("EXIT") or op.startswith("BRA") and False]
for m in marks[:30]: print(m[0], m[1], m[2].strip()[:60])
# counts of LDL/STL/HGMMA/UTMALDG/LDG between marks
bounds = [0] + [m[0] for m in marks] + [len(ins)]
for a, b in zip(bounds, bounds[1:]):
    c = collections.Counter(op.split(".")[0] for _, _, op, _ in ins[a:b])
    print(a, b, {k: c[k] for k in ("LDL", "STL", "LDG", "HGMMA", "UTMALDG", "SYNCS", "MUFU", "FMNMX") if c[k]})
