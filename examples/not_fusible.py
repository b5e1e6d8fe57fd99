"""Mean absolute deviation: sum_j |x - mean_j x| cannot be corrected after the fact
(abs does not factor), so acefuse says why and emits a correct two-pass kernel."""
import acefuse as af

x = af.tensor("x", "r j")
mu = af.mean(x, "j")
mad = af.program("mean_abs_dev", out=af.sum(af.abs(x - mu), "j") / af.size("j"))
