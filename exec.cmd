@rem npm runs package scripts with cmd.exe on Windows, which has no "exec": this runs the rest
@rem of the line, so "exec node ..." (package.json "start") works there as in sh. See server/launcher.ts.
@%*
