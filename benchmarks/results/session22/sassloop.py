import re, sys
s = open(sys.argv[1]).read()
ins = re.findall(r"/\*([0-9a-f]{4,})\*/\s+((?:@!?U?P\w+\s+)?)([A-Z][A-Z0-9_.]+)([^;]*);", s)
a, b = int(sys.argv[2]), int(sys.argv[3])
h = [i for i in range(a, b) if ins[i][2].startswith("HGMMA")]
print("HGMMA span", h[0], h[-1])
# loops: backward branches
for i in range(a, b):
    op = ins[i][2]
    if op.startswith("BRA"):
        m = re.search(r"0x([0-9a-f]+)", ins[i][3])
        if m:
            tgt = int(m.group(1), 16); cur = int(ins[i][0], 16)
            if tgt < cur:
                # find index of target
                ti = next(k for k in range(a, b) if int(ins[k][0], 16) >= tgt)
                body = ins[ti:i + 1]
                c = lambda o: sum(1 for x in body if x[2].startswith(o))
                print(f"loop {ti}-{i}: {i-ti} instrs, HGMMA {c('HGMMA')}, LDL {c('LDL')}, STL {c('STL')}, LDG {c('LDG')}, MUFU {c('MUFU')}")
