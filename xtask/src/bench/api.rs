use anyhow::{Result, bail};

use super::{Ctx, Section};

pub fn run(ctx: &Ctx) -> Result<Section> {
    if !ctx.has_flag("--collect") {
        bail!("this dynprof has no api collector yet (`attach --collect`)");
    }
    bail!("not implemented yet")
}
